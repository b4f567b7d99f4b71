"""Messages between a server process and its writer process: pickled Python objects over a
Unix SOCK_SEQPACKET socket (boundaries kept, file descriptors passed beside a message).

A message larger than one packet goes as several, each flagged whether more follow; its
descriptors ride on the first. A closed peer reads as EOFError.
"""

from __future__ import annotations

import array
import pickle
import socket
import threading
from typing import Any, List, Optional, Sequence, Tuple

_PACKET = 32 << 10  # under the default socket buffer, whatever the host's limits
_MORE, _LAST = b"\x01", b"\x00"
_MAX_FDS = 16


def _recv_fds(sock: socket.socket, flags: int) -> Tuple[bytes, List[int]]:
    """One packet and its descriptors (socket.recv_fds, which drops `flags` before Python 3.12)."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(_PACKET + 1, socket.CMSG_LEN(_MAX_FDS * fds.itemsize), flags)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def pair(cls) -> Tuple["Channel", socket.socket]:
        """This side's channel and the other side's socket (to hand to the child)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(a), b

    @classmethod
    def from_fd(cls, fd: int) -> "Channel":
        return cls(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd))

    def send(self, msg: Any, fds: Sequence[int] = ()) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        pieces = [data[i:i + _PACKET] for i in range(0, len(data), _PACKET)] or [b""]
        with self._send_lock:
            for i, piece in enumerate(pieces):
                flag = _MORE if i < len(pieces) - 1 else _LAST
                if i == 0 and fds:
                    socket.send_fds(self.sock, [flag + piece], list(fds))
                else:
                    self.sock.sendall(flag + piece)

    def recv(self) -> Tuple[Any, List[int]]:
        """The next message and the descriptors that came with it. EOFError: the peer is gone."""
        return self._recv(0)

    def try_recv(self) -> Optional[Tuple[Any, List[int]]]:
        """recv without waiting: None when no message has come (the rest of a message that has
        begun is waited for: its packets were sent together)."""
        try:
            return self._recv(socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    def _recv(self, first_flags: int) -> Tuple[Any, List[int]]:
        parts, fds = [], []
        flags = first_flags
        while True:
            data, got = _recv_fds(self.sock, flags)
            flags = 0
            if not data:
                raise EOFError("the peer closed the channel")
            fds += got
            parts.append(data[1:])
            if data[:1] == _LAST:
                return pickle.loads(b"".join(parts)), fds

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
