"""Imported last by a fork server (``plait.runtime.spawn``, ``plait.launch``): moves every object the server holds
(torch's, plait's and whatever else it preloaded: ~400k with the test suite's list) into the garbage collector's
permanent generation, which no collection scans.

The processes forked from the server share those objects' pages with it. Unfrozen, each one's first full
collection (one runs after every ~100k surviving allocations: building a model, compiling one) scans them all and
writes their headers, copying the pages: 0.5-2 s per collection in each rank, measured. Frozen, a collection
scans only what the process made itself (CPython's ``gc.freeze`` documents this use). They are the server's
imports, which live as long as the process anyway; at its exit they are unfrozen, so that the interpreter's
shutdown frees them as before (extension modules check at exit that their objects were freed: nanobind's print
"leaked function" warnings otherwise).
"""

import atexit
import gc

gc.freeze()
atexit.register(gc.unfreeze)
