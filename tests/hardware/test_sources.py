"""Citation records: parsing, the quoted number's place in the printed text, and the comparison with a value."""

import pytest

from tessera.hardware.sources import CitationError, parse_citation, parse_document

DOCS = {"ds": parse_document("ds", {"title": "A datasheet", "url": "https://example.com/ds.pdf"})}


def test_a_printed_number_is_found_with_commas_and_not_inside_another_number():
    cite = parse_citation("bandwidth_tb_s", {"doc": "ds", "printed": "Bandwidth 2,039GB/s", "number": 2039,
                                             "convert": ["GB/s to TB/s"]}, DOCS)
    assert cite.expected() == pytest.approx(2.039) and cite.matches(2.039) and not cite.matches(2.1)
    with pytest.raises(CitationError, match="number 8 does not appear"):
        parse_citation("memory_gb", {"doc": "ds", "printed": "GPU Memory 80GB", "number": 8}, DOCS)
    with pytest.raises(CitationError, match="number 362 does not appear"):
        parse_citation("tflops.fp8", {"doc": "ds", "printed": "FP8 362.1 | 724*", "number": 362}, DOCS)
    assert parse_citation("compute_capability", {"doc": "ds", "printed": "9.0 | H100", "number": 9}, DOCS).number == 9


def test_conversions_multiply_in_order():
    cite = parse_citation("tflops.tf32", {"doc": "ds", "printed": "TF32 2.2 PFLOPS*", "number": 2.2,
                                          "convert": ["PFLOPS to TFLOPS", "sparse to dense"]}, DOCS)
    assert cite.factor() == 500 and cite.expected() == pytest.approx(1100)
    assert cite.text() == "TF32 2.2 PFLOPS* (PFLOPS to TFLOPS; sparse to dense)"


def test_a_null_value_takes_no_number():
    cite = parse_citation("nvlink_gb_s", {"status": "derived", "note": "no NVLink"}, DOCS)
    assert cite.matches(None) and cite.expected() is None
    printed = parse_citation("nvlink_gb_s", {"doc": "ds", "printed": "NVLink bridge 600GB/s"}, DOCS)
    assert printed.matches(None) and not printed.matches(300)


@pytest.mark.parametrize("data,message", [
    ({"status": "guessed", "note": "x"}, "status must be one of"),
    ({"printed": "80GB", "number": 80}, "names its document"),
    ({"doc": "ds", "number": 80}, "quotes the document"),
    ({"status": "unconfirmed", "doc": "ds"}, "says how it was obtained"),
    ({"doc": "ds", "printed": "80GB", "number": "80"}, "'number' must be a number"),
    ({"doc": "ds", "printed": "80GB", "colour": "red"}, "unknown field 'colour'"),
    ("80GB", "expected a mapping"),
])
def test_bad_citations_say_what_is_wrong(data, message):
    with pytest.raises(CitationError, match=message):
        parse_citation("memory_gb", data, DOCS)


def test_documents_need_a_title_and_urls():
    with pytest.raises(CitationError, match="non-empty 'title'"):
        parse_document("x", {"url": "https://example.com"})
    with pytest.raises(CitationError, match="http"):
        parse_document("x", {"title": "X", "copies": ["not a url"]})
    with pytest.raises(CitationError, match="unknown field 'copy'"):
        parse_document("x", {"title": "X", "copy": "https://example.com"})
