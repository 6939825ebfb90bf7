import sys

from trainer.check.compare import main

sys.exit(main())
