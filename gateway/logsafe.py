"""Log lines a client cannot forge: control characters in a message (a newline in an sdk_version, a path, an
exception text) are escaped, and every line of a traceback is indented under its record, so no client string
can start a line of its own in the gateway's log."""

from __future__ import annotations

import logging
import re
import sys

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1, line and paragraph separators) as an escape."""
    return _CONTROL.sub(_escaped, text)


class SafeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        blocks = [record.exc_text] if record.exc_text else []
        if record.stack_info:
            blocks.append(self.formatStack(record.stack_info))
        for block in blocks:
            line += "".join(f"\n    | {escape(part)}" for part in block.splitlines())
        return line


def configure(level: str) -> None:
    """The gateway's logging: one stderr handler with SafeFormatter on the root logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
