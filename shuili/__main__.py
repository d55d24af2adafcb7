import sys

from shuili.cli import main

sys.exit(main())
