"""``python -m storage`` runs one store node (same flags as ``streamflow store serve``)."""

import sys

from storage.server import main

sys.exit(main())
