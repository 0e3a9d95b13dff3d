"""One PagedChat per data folder.

Two instances on one database each believe they own it: the second marked the first one's
live replies "interrupted" at open. A QLockFile in the data folder decides who owns it (a
lock left by a crashed process is taken over: Qt checks that its process is gone), and a
QLocalServer named after the folder lets a second launch ask the first to come to the front
instead of starting.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, Qt, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket
from PySide6.QtWidgets import QWidget

LOCK_NAME = "pagedchat.lock"
ACTIVATE = b"activate\n"
ACK = b"ok\n"
ANSWER_MS = 3000


def server_name(data_dir: Path) -> str:
    digest = hashlib.sha256(str(data_dir.resolve()).encode("utf-8", "replace")).hexdigest()
    return f"pagedchat-{digest[:20]}"


class SingleInstance(QObject):
    """The data folder's lock and the server that answers later launches."""

    activationRequested = Signal()  # another launch wants this instance's window in front

    def __init__(self, data_dir: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.data_dir = Path(data_dir)
        self.name = server_name(self.data_dir)
        self._lock = QLockFile(str(self.data_dir / LOCK_NAME))
        self._lock.setStaleLockTime(0)  # never stale by age; stale only when its process died
        self._server: QLocalServer | None = None

    def acquire(self) -> str | None:
        """Take the folder; None on success, else why not ("held" or a sentence)."""
        if self._lock.tryLock(0):
            self._listen()
            return None
        if self._lock.error() == QLockFile.LockError.LockFailedError:
            return "held"
        return f"the data folder {self.data_dir} is not writable (its lock file cannot be created)"

    def holder(self) -> str:
        info = self._lock.getLockInfo()  # PySide6 gives (pid, host, app); C++ adds an ok flag
        if len(info) == 4:
            ok, pid, host = info[0], info[1], info[2]
        else:
            pid, host = info[0], info[1]
            ok = bool(pid)
        return f"process {pid} on {host}" if ok else "another process"

    def ask_running_instance(self) -> bool:
        """Ask the instance holding the folder to bring its window forward; True if it did."""
        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if not sock.waitForConnected(ANSWER_MS):
            return False
        sock.write(ACTIVATE)
        sock.flush()
        answer = b""
        while ACK not in answer and sock.waitForReadyRead(ANSWER_MS):
            answer += bytes(sock.readAll().data())
        sock.disconnectFromServer()
        return ACK in answer

    def release(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._lock.unlock()

    def _listen(self) -> None:
        QLocalServer.removeServer(self.name)  # a socket left by a crashed owner: we own it now
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if server.listen(self.name):
            server.newConnection.connect(self._on_connection)
            self._server = server

    def _on_connection(self) -> None:
        assert self._server is not None
        while self._server.hasPendingConnections():
            sock = self._server.nextPendingConnection()
            sock.readyRead.connect(lambda s=sock: self._on_request(s))
            sock.disconnected.connect(sock.deleteLater)

    def _on_request(self, sock: QLocalSocket) -> None:
        if ACTIVATE.strip() in bytes(sock.readAll().data()):
            self.activationRequested.emit()
            sock.write(ACK)
            sock.flush()


def bring_to_front(window: QWidget) -> None:
    """Un-minimise, show and raise a top-level window (what the second launch asked for)."""
    state = window.windowState() & ~Qt.WindowState.WindowMinimized
    window.setWindowState(state | Qt.WindowState.WindowActive)
    window.show()
    window.raise_()
    window.activateWindow()
