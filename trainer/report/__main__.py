import sys

from trainer.interpreter import lean_imports

with lean_imports():
    from trainer.report.sweep import main

sys.exit(main())
