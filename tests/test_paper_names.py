"""Papers are selected by name (``deqbench reproduce pcdeq``) as well as by their numbers."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from deqbench.cli import app
from deqbench.core.errors import ConfigError
from deqbench.reproduce.claims import CLAIMS
from deqbench.reproduce.run import select_claims


def _ids(papers):
    return [c.id for c in select_claims(papers)]


@pytest.mark.parametrize(
    "name, number",
    [("kglm", "001"), ("pcdeq", "002"), ("opteq", "003"), ("thesis", "004"), ("ntk", "004")],
)
def test_a_paper_name_selects_the_claims_of_its_number(name, number):
    ids = _ids([name])
    assert ids and ids == _ids([number]) == [c.id for c in CLAIMS if c.paper == number]
    assert _ids([name.upper()]) == ids  # case-insensitive
    assert _ids([number.lstrip("0")]) == ids  # the numbers stay aliases


def test_names_and_numbers_mix_and_unknown_names_list_the_known_ones():
    assert set(_ids(["pcdeq", "003"])) == set(_ids(["002"])) | set(_ids(["opteq"]))
    with pytest.raises(ConfigError, match=r"unknown paper 'monde'.*pcdeq \(002\)"):
        select_claims(["monde"])


def test_reproduce_help_lists_the_paper_names():
    out = CliRunner().invoke(app, ["reproduce", "--help"], env={"COLUMNS": "200"}).output
    for name in ("kglm", "pcdeq", "opteq", "thesis", "ntk"):
        assert name in out, name


def test_claim_ids_by_the_papers_name():
    from deqbench.reproduce.run import claim_id, select_claims

    assert claim_id("pcdeq-lipschitz") == "002-lipschitz"
    assert claim_id("THESIS-pr-fb") == "004-pr-fb"
    assert claim_id("001-init-cost") == "001-init-cost"
    assert [c.id for c in select_claims(ids=["kglm-init-cost"])] == ["001-init-cost"]
    assert [c.id for c in select_claims(ids=["002-lipschitz"])] == ["002-lipschitz"]
