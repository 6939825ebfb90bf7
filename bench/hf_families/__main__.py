import sys

from bench.hf_families.sweep import main

sys.exit(main())
