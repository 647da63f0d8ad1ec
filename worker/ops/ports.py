"""Local TCP ports: whether one is taken, and by which process, so that an error can say what to stop."""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def port_holder(port: int) -> str | None:
    """``pid N (command line)`` of the process listening on TCP ``port``, or None when it cannot be told
    (not Linux, or a process of another user, whose file descriptors are not ours to read)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
        if _open_files(pid) & targets:
            return f"pid {pid} ({_command_line(pid)})"
    return None


def in_use_message(port: int, option: str) -> str:
    """'port P is already in use by pid N (...); ...' naming the holder where it can be told, and the way out."""
    holder = port_holder(port)
    if holder is None:
        return f"port {port} is already in use by another program; stop it or pick another port with {option}"
    pid = holder.split()[1]
    return f"port {port} is already in use by {holder}; stop it (kill {pid}) or pick another port with {option}"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _open_files(pid: str) -> set[str]:
    """What the file descriptors of ``pid`` point at (none if they are not ours to read)."""
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    links = set()
    for fd in descriptors:
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
    return links


def _command_line(pid: str, limit: int = 120) -> str:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [word.decode(errors="replace") for word in words if word]
    text = " ".join(" ".join([os.path.basename(words[0])] + words[1:]).split()) if words else "?"
    return text if len(text) <= limit else text[: limit - 1] + "…"
