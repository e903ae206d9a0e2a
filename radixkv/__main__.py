"""`python -m radixkv ...` is the `radixkv` command."""

import sys

from radixkv.cli.main import main

sys.exit(main())
