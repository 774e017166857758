import sys

from topoagent.cli import main

sys.exit(main())
