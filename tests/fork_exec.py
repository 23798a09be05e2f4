"""`python -m tests.fork_exec MODULE ARGS...`: what a launcher (torchrun) starts as a rank in a test, in
place of `python -m MODULE ARGS...`: the rank is forked by the server `DFLASH_TEST_FORK_SERVER` names
(tests/cli_fork.py, started by the test with `fork_env`), so it skips the ~10 CPU-s of imports.

This process stays the launcher's child and stands for the rank: the rank's stdin, stdout and stderr are
its own; the signals the launcher sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1/2) are passed on; it exits with
the rank's code, or dies of the rank's signal; killed itself (SIGKILL), it takes the rank with it (the
server's handler sees its socket close). Without a server, or with an environment the server's imports
read otherwise, it becomes the plain command (exec): nothing is forked."""

import os
import signal
import sys

from tests import cli_fork


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    folder = os.environ.get(cli_fork.SERVER_ENV)
    srv = cli_fork._Attached(folder) if folder and os.path.isdir(folder) else None
    env = {k: v for k, v in os.environ.items() if k != cli_fork.SERVER_ENV}
    if srv is None or not srv.serves(env):
        os.execve(sys.executable, [sys.executable, "-m", module, *args], env)
    sock = cli_fork._start(srv, module, args, env, os.getcwd(), [0, 1, 2])
    pid = cli_fork._recv(sock)["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    status = cli_fork._recv(sock)
    code = status["code"] if status else -int(signal.SIGKILL)
    if code < 0:  # killed by a signal: so is this process, as the launcher would see the rank
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
