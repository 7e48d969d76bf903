"""``lockstep`` with a 16 KB send buffer on every accepted socket: run as ``python small_send_buffers.py serve ...``.

The kernel buffers what a client has not read yet, and on localhost Linux grows a socket's send buffer to 4 MB
(thousands of streamed tokens) before the server itself sees a stall. Capped, as for a distant client, the stall
comes after a few hundred. Used by tests/server/test_reliability.py and bench/reliability.py.
"""

import socket
import sys

_accept = socket.socket.accept


def _accept_with_small_buffers(self: socket.socket) -> tuple[socket.socket, object]:
    conn, address = _accept(self)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    return conn, address


if __name__ == "__main__":
    from lockstep.cli import main

    socket.socket.accept = _accept_with_small_buffers
    sys.exit(main(sys.argv[1:]))
