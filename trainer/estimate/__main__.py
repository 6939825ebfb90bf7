import sys

from trainer.interpreter import lean_imports

with lean_imports():
    from trainer.estimate.cli import main

sys.exit(main())
