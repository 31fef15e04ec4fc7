"""A PS gradient table's shape against its declared ``dim`` (persia.messages.check_grad_table): the
one check that the gRPC schema, the in-process client of a colocated PS and the PS's own Update
handler share, so a gradient of another width never updates another dim's table."""

from __future__ import annotations

import numpy as np
import pytest

from persia import messages as M


def _table(dim: int, n: int, width: int | None = None, rows: int | None = None) -> dict:
    return {"dim": dim, "signs": np.arange(1, n + 1, dtype=np.uint64),
            "grads": np.zeros((n if rows is None else rows, dim if width is None else width), np.float32)}


def test_a_matching_table_passes():
    t = _table(8, 5)
    M.check_grad_table(t["dim"], t["signs"], t["grads"])
    M.check_grad_table(4, np.zeros(0, np.uint64), np.zeros((0, 4), np.float32))  # an empty table


def test_a_gradient_wider_or_narrower_than_dim_names_dim_and_both_widths():
    for width in (16, 4):
        t = _table(8, 5, width=width)
        with pytest.raises(ValueError) as err:
            M.check_grad_table(t["dim"], t["signs"], t["grads"])
        text = str(err.value)
        assert "field 'dim' is 8" in text and f"{width} columns" in text and f"(5, {width})" in text


def test_rows_must_match_the_ids_and_grads_must_be_2d():
    t = _table(8, 5, rows=3)
    with pytest.raises(ValueError, match=r"3 rows \(shape \(3, 8\)\) for the 5 IDs of field 'signs'"):
        M.check_grad_table(t["dim"], t["signs"], t["grads"])
    with pytest.raises(ValueError, match=r"'grads' must be 2-D .*got shape \(40,\)"):
        M.check_grad_table(8, t["signs"], np.zeros(40, np.float32))


@pytest.mark.parametrize("schema, wrap", [
    (M.PsUpdate, lambda tables: {"tables": tables}),
    (M.PsStep, lambda tables: {"update": {"tables": tables},
                               "lookup": {"train": True, "tables": [{"dim": 8, "signs": np.arange(3, dtype=np.uint64)}]}}),
])
def test_the_schemas_refuse_a_request_whose_later_table_has_the_wrong_width(schema, wrap):
    """The whole request is refused, naming the table: nothing of it reaches the handler."""
    good, bad = _table(8, 5), _table(8, 5, width=16)
    assert M.validate(schema, wrap([good, _table(16, 2)])) is not None
    with pytest.raises(M.MessageError) as err:
        M.validate(schema, wrap([good, bad]), "persia.EmbeddingParameterServer/Update")
    text = str(err.value)
    assert "tables.1" in text and "field 'dim' is 8" in text and "16 columns" in text
    assert "array(" not in text  # the values are named, not the table dumped
