"""A library thread that outlives the agent: started at import, never ended, not a daemon.

CUDA builds of PyTorch keep such threads (their pools); at interpreter shutdown
one made the volunteer's Ctrl-C end in SIGABRT. A plain Python thread shows the
same fault as a hang: the interpreter waits for it for ever.
"""

import threading

threading.Thread(target=threading.Event().wait, name="lingering-pool", daemon=False).start()
