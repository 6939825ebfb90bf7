import sys

from trainer.export.cli import main

sys.exit(main())
