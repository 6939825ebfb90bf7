import sys

from trainer.interpreter import lean_imports

with lean_imports():
    from trainer.check.compare import main

sys.exit(main())
