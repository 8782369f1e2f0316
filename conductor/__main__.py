import sys

from conductor.cli.main import main

sys.exit(main())
