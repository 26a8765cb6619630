import sys

from oea.cli import main

sys.exit(main())
