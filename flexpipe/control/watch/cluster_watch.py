"""Watch the cluster file: every `interval_s`, look at its stamp (mtime, size, inode) and, when
that moved, at its content hash; a new content is parsed and compared with the last good
cluster (`resources.diff`). A file read within a second of its mtime is read again at the next
poll even if its stamp did not move (a same-size rewrite in one mtime tick keeps the stamp).

A file with mistakes (or gone, or unreadable) keeps the last good cluster: its error is
reported once through `report` (not at every poll) and again only when it changes; the next
good content is compared with the last good cluster, so nothing in between is lost.

    watch = ClusterWatch("cluster.yaml", interval_s=2.0)     # first read must be good
    async for cluster, events in watch.changes():           # forever; cancel to stop
        resources, events = resources.file_changed(cluster, now_s)   # with the admin's overrides

`sleep` and `clock` are injected: tests step the watcher without waiting, and `poll(now_s)`
is the whole logic, synchronous, for exact tests. Parsing runs in a worker thread so that a
large file does not stall the controller's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from flexpipe.cluster import Cluster, ClusterError, parse_cluster_yaml
from flexpipe.control.watch.poller import Change, changed, check_interval, poll_changes, report_once

__all__ = ["ClusterWatch"]

log = logging.getLogger("flexpipe.control.watch.cluster_watch")

_Stamp = tuple[int, int, int]  # (st_mtime_ns, st_size, st_ino)
_RACY_S = 1.0  # a file read this soon after its mtime is read again at the next poll


def _log_warning(line: str) -> None:
    log.warning("%s", line)


class ClusterWatch:
    """The cluster file as last read well, and the changes since."""

    def __init__(
        self,
        path: str | Path,
        interval_s: float = 2.0,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        report: Callable[[str], None] = _log_warning,
    ) -> None:
        self.path = Path(path)
        self.interval_s = check_interval(interval_s)
        self._sleep = sleep
        self._clock = clock
        self._report = report
        self.num_polls = 0
        self.num_reads = 0  # times the content was read (the stamp had moved)
        self.error: str | None = None  # the current file's problem, None when it is good
        self._racy = False
        stamp, data = self._read()  # the first read must succeed: there is nothing to keep
        self._stamp: _Stamp | None = stamp
        self._digest = hashlib.sha256(data).digest()
        self.cluster: Cluster = self._parse(data)
        self._content_ok = True  # the last content read parsed well

    def _read(self) -> tuple[_Stamp, bytes]:
        try:
            st = os.stat(self.path)
            data = self.path.read_bytes()
        except OSError as exc:
            raise ClusterError(
                [f"{self.path}: cannot read the file: {exc.strerror or exc}"]
            ) from None
        self.num_reads += 1
        # Read within a second of its last change: a rewrite of the same size in the same
        # mtime tick would keep the stamp, so the next poll reads it again ("racy git").
        self._racy = time.time() - st.st_mtime_ns / 1e9 < _RACY_S
        return (st.st_mtime_ns, st.st_size, st.st_ino), data

    def _parse(self, data: bytes) -> Cluster:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ClusterError([f"{self.path}: cannot read the file: {exc}"]) from None
        return parse_cluster_yaml(text, str(self.path))

    def _fail(self, exc: ClusterError) -> None:
        line = "; ".join(exc.errors) + " (keeping the last good cluster)"
        self.error = report_once(self.error, line, self._report)

    def _recovered(self) -> None:
        if self.error is not None:
            log.info("%s: readable and valid again", self.path)
            self.error = None

    def poll(self, now_s: float) -> Change | None:
        """Look at the file once. Returns the new cluster and `diff(last good, new, now_s)`
        when the content changed into a good cluster that differs from the last good one;
        None otherwise (unchanged stamp, same content, same cluster, or a bad file)."""
        self.num_polls += 1
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._stamp = None  # read again as soon as it is back
            self._fail(ClusterError([f"{self.path}: cannot read the file: {exc.strerror or exc}"]))
            return None
        if (st.st_mtime_ns, st.st_size, st.st_ino) == self._stamp and not self._racy:
            return None
        try:
            stamp, data = self._read()
        except ClusterError as exc:
            self._fail(exc)
            return None
        self._stamp = stamp
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:  # the same content as last read
            if self._content_ok:
                self._recovered()  # it was unreadable for a while, now back as it was
            return None
        self._digest = digest
        try:
            cluster = self._parse(data)
        except ClusterError as exc:
            self._content_ok = False
            self._fail(exc)
            return None
        self._content_ok = True
        self._recovered()
        change = changed(self.cluster, cluster, now_s)
        self.cluster = cluster
        return change

    def changes(self) -> AsyncIterator[Change]:
        """`poll` every `interval_s`; each change (cancel the consuming task to stop)."""
        return poll_changes(self.poll, self.interval_s, self._sleep, self._clock)
