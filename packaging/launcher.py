"""The frozen app's entry script (packaging/pagedchat.spec): runs app.main.main().

A separate file rather than app/main.py itself, so that app.main is imported once as a module
(not also as ``__main__``). ``freeze_support`` makes any child process a library spawns
through multiprocessing run that child's code instead of a second copy of the app.
"""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from app.main import main

    sys.exit(main())
