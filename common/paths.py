"""Runtime paths every process of a node shares: the private directory of local sockets.

The agent's hook socket and the workers' reply sockets are unix datagram sockets; any
local user who can reach one can send to it (once `/tmp/unbroken-agent.sock` could be
squatted, and the workers' abstract-namespace reply sockets took a `stop` from anyone).
They therefore live in a directory only this user can enter, `runtime_dir()`:
`$XDG_RUNTIME_DIR/unbroken` when that is ours, else `/run/unbroken` for root, else
`<tmp>/unbroken-<uid>`; `private_dir` creates it 0700 and refuses one that is a symlink,
not a directory, or owned by someone else. The socket files are 0600 as well.

`DEFAULT_SOCKET` is the agent's hook socket when neither `--socket` nor
`UNBROKEN_AGENT_SOCKET` names one: the first agent of a host takes it, and a script started
by another launcher finds it there. `SYSTEM_SOCKET` is where the system agent (the systemd
unit, another user) listens; a script looks there when it has no agent of its own.

A system agent serves other users through a group (`--socket-group`): its socket directory
is `shared_dir` (owner the agent, group that group, mode 1770: members may bind their reply
sockets there and the sticky bit keeps them from removing anyone else's; no setgid bit,
which a unit with RestrictSUIDSGID= may not set) and its socket is 0660. `trusted_socket`
accepts such a socket from a member of its group: the socket and its directory belong to
the same user and nobody outside may write the directory.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile


class UnsafeRuntimeDirError(OSError):
    """A runtime directory another user could read, write or replace."""


def runtime_dir() -> str:
    """This user's directory for local sockets (not created here; see `private_dir`)."""
    uid = os.geteuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg:
        try:
            st = os.stat(xdg)
            if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
                return os.path.join(xdg, "unbroken")
        except OSError:
            pass
    if uid == 0 and os.access("/run", os.W_OK):
        return "/run/unbroken"
    return os.path.join(tempfile.gettempdir(), f"unbroken-{uid}")


def check_private(path: str) -> None:
    """UnsafeRuntimeDirError unless `path` is a real directory of ours, closed to others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDirError(f"{path} is a symlink or not a directory; refused")
    if st.st_uid != os.geteuid():
        raise UnsafeRuntimeDirError(
            f"{path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}); another user "
            "may have planted it. Remove it, or set XDG_RUNTIME_DIR / --socket elsewhere"
        )
    if st.st_mode & 0o077:
        raise UnsafeRuntimeDirError(f"{path} is open to other users (mode {st.st_mode & 0o777:o})")


def private_dir(path: str | None = None) -> str:
    """Create (0700) or check the directory `path` (default `runtime_dir()`); return it.

    Raises:
        UnsafeRuntimeDirError: it exists as a symlink, a file, or another user's directory.
    """
    path = path or runtime_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077:
            os.chmod(path, 0o700)  # ours, too open: close it
    check_private(path)
    return path


def trusted_socket(path: str) -> str:
    """Why the agent socket at `path` must not be trusted ('' when it may).

    Its owner must be this user or root, and so must its directory, which others may not
    write unless it is sticky (as /tmp is): then nobody else can have replaced the file.
    """
    me = os.geteuid()
    try:
        st = os.stat(path)
        dst = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        return f"cannot stat {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid not in (me, 0) and not shared_with_us(st, dst):
        return (
            f"{path} belongs to uid {st.st_uid}, not to us or root (a squatter?), and is "
            "not a system agent's socket shared with a group of ours"
        )
    if dst.st_uid not in (me, 0, st.st_uid):
        return f"the directory of {path} belongs to uid {dst.st_uid}"
    if dst.st_mode & 0o022 and not dst.st_mode & stat.S_ISVTX:
        return f"the directory of {path} is writable by others"
    return ""


def our_groups() -> set[int]:
    """The group ids this process holds (effective and supplementary)."""
    return {os.getegid(), *os.getgroups()}


def shared_with_us(sock: os.stat_result, directory: os.stat_result) -> bool:
    """Whether a socket of another user is a group-shared agent socket we may use: it and
    its directory belong to that user, the socket's group is one of ours and may write it,
    and the directory is sticky (members cannot replace what is not theirs) and closed to
    users outside the group."""
    return (
        sock.st_uid == directory.st_uid
        and sock.st_gid in our_groups()
        and bool(sock.st_mode & 0o020)
        and bool(directory.st_mode & stat.S_ISVTX)
        and not directory.st_mode & 0o002
    )


def group_id(name: str) -> int:
    """The id of group `name` (a number is taken as an id).

    Raises:
        ValueError: no such group, saying how to create it.
    """
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(
            f"--socket-group {name!r}: no such group on this host; create it (`groupadd "
            f"{name}`, or the sysusers.d file deploy/systemd/unbroken.sysusers.conf) and add "
            "the users whose jobs use the hooks SDK"
        ) from None


def uid_in_group(uid: int, gid: int) -> bool:
    """Whether the user `uid` is a member of group `gid` (primary or supplementary), by the
    host's user database."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    return pw.pw_gid == gid or gid in os.getgrouplist(pw.pw_name, pw.pw_gid)


def shared_dir(path: str, gid: int) -> str:
    """Create or check `path` as this user's directory shared with group `gid`: mode 1770
    (sticky: members cannot remove one another's files). Refuses, like `private_dir`, a
    symlink, a file or another user's directory.

    Raises:
        UnsafeRuntimeDirError: it exists as a symlink, a file, or another user's directory.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDirError(f"{path} is a symlink or not a directory; refused")
    if st.st_uid != os.geteuid():
        raise UnsafeRuntimeDirError(
            f"{path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}); remove it "
            "or choose another --socket"
        )
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise UnsafeRuntimeDirError(
            f"cannot give {path} to group {gid}: this process (uid {os.geteuid()}) is not "
            "a member of it; add the agent's user to the group (the systemd unit's "
            "SupplementaryGroups=)"
        ) from None
    if st.st_mode & 0o7777 != 0o1770:
        os.chmod(path, 0o1770)
    return path


DEFAULT_SOCKET = os.path.join(runtime_dir(), "agent.sock")
SYSTEM_SOCKET = "/run/unbroken/agent.sock"
