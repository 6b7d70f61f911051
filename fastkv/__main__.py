"""``fastkv-supervisor`` (also ``python -m fastkv``): the CLI with SIGINT and SIGTERM held back
until its own handlers are in.

Importing Paddle installs a C-level handler for SIGTERM (and others) that writes a stack trace
and exits; run from a signal that interrupted malloc, it can corrupt the heap and hang. Blocked
here, before any import starts a thread (numpy's, Paddle's), the signals stay blocked in every
thread those imports start; ``fastkv.cli`` unblocks them in the main thread once its handlers
are installed, so a signal from then on (or one that came meanwhile) stops the run cleanly.
"""
import signal
import sys

HELD = {signal.SIGINT, signal.SIGTERM}


def main() -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    from fastkv import cli

    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
