"""DocumentRegistry: content-addressed ids, records that survive a restart, damaged records ignored."""

from __future__ import annotations

import pytest

from semkv.server.documents import Document, DocumentRegistry, document_id
from semkv.store.keys import Namespace

NS = Namespace()


def test_ids_are_content_addresses_and_records_persist(tmp_path):
    registry = DocumentRegistry(tmp_path)
    doc = DocumentRegistry.new("some text", 2, ["a" * 64])
    registry.put(doc, NS)
    assert doc.id == document_id("some text") and doc.precomputed
    restarted = DocumentRegistry(tmp_path)
    assert restarted.get(doc.id, NS) == doc and [d.id for d in restarted.list(NS)] == [doc.id]
    assert restarted.get("doc-" + "0" * 32, NS) is None and restarted.get("../x", NS) is None


def test_damaged_record_is_ignored(tmp_path, caplog):
    registry = DocumentRegistry(tmp_path)
    doc = DocumentRegistry.new("other text", 2, [])
    registry.put(doc, NS)
    (tmp_path / f"{doc.id}.json").write_text('{"id": "doc-1", "text": ')
    assert DocumentRegistry(tmp_path).get(doc.id, NS) is None
    assert "unreadable document record" in caplog.text


def test_record_must_match_its_text():
    with pytest.raises(ValueError, match="does not match its text"):
        Document(document_id("one"), "two", 1)
