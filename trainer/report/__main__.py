import sys

from trainer.report.sweep import main

sys.exit(main())
