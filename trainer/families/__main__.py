import sys

from trainer.interpreter import lean_imports

with lean_imports():
    from trainer.families.sweep import main

sys.exit(main())
