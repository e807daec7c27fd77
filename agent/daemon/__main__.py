import sys

from agent.daemon.main import main

sys.exit(main())
