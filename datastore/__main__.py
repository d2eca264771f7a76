import sys

from datastore.cli import main

sys.exit(main())
