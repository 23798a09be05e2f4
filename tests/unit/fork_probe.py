"""What a process forked by tests/cli_fork.py is (tests/unit/test_cli_fork.py): printed as one JSON line.

python -m tests.unit.fork_probe EXIT_CODE [SLEEP_S]
"""

import atexit
import json
import os
import random
import sys
import threading
import time


def main() -> int:
    code, sleep_s = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    preloaded = "huggingface_hub.constants" in sys.modules
    from huggingface_hub import constants as hub  # read its HF_HOME as this process sees it

    print(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgrp(), "cwd": os.getcwd(), "argv": sys.argv,
        "env": {k: v for k, v in os.environ.items() if k.startswith("PROBE_")},
        "hf_home": hub.HF_HOME, "random": random.random(), "preloaded": preloaded,
    }))  # fmt: skip
    if os.environ.get("PROBE_PIDFILE"):
        with open(os.environ["PROBE_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    atexit.register(lambda: print("atexit ran", file=sys.stderr))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", file=sys.stderr))).start()
    time.sleep(sleep_s)
    return code


if __name__ == "__main__":
    sys.exit(main())
