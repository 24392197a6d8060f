"""autofit.runtime.messages without child processes: the reader's decoding, a result's status as the enum."""

from __future__ import annotations

from autofit.core.records import TrialStatus
from autofit.runtime.messages import MessageReader, result_status


def test_reader_decodes_whole_lines_and_says_what_is_not_a_message():
    reader = MessageReader()
    reader.feed(b'{"a": 1}\n{"b"')
    assert list(reader.messages) == [{"a": 1}] and reader.error is None
    reader.feed(b': 2}\n[1]\n')
    assert list(reader.messages) == [{"a": 1}, {"b": 2}]
    assert reader.error == "a message that is not a JSON object"


def test_reader_on_close_reports_a_cut_message():
    reader = MessageReader()
    reader.feed(b'{"a": ')
    reader.close()
    assert reader.error == "a truncated message" and not reader.messages
    reader.close()  # idempotent
    assert reader.error == "a truncated message"


def test_result_status_reads_the_string_value_as_the_enum():
    assert result_status({"status": "ok"}) is TrialStatus.OK
    assert result_status({"status": TrialStatus.OOM}) is TrialStatus.OOM
    assert result_status({"status": "no such status"}) is TrialStatus.ERROR
    assert result_status(None) is result_status({}) is TrialStatus.ERROR
    assert result_status({"status": None}, missing=TrialStatus.OK) is TrialStatus.OK
