import sys

from trainer.estimate.cli import main

sys.exit(main())
