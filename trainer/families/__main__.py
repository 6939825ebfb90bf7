import sys

from trainer.families.sweep import main

sys.exit(main())
