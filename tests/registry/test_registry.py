"""Registry API semantics on SQLite and PostgreSQL: versions, switches, CAS, rollback, history."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from tasks.base.errors import InvalidInputError
from tasks.registry import (
    ArtifactRef,
    ConflictError,
    ForceRequiredError,
    Lineage,
    NotFoundError,
    NothingToRollBackError,
    PromotionRequiredError,
    Registry,
    upgrade,
)

LINEAGE = Lineage(config_hash="cfg", data_manifest_hash="data", code_revision="rev", checkpoint_tag="step-10")


def ref(n: int) -> ArtifactRef:
    digest = hashlib.sha256(f"artifact-{n}".encode()).hexdigest()
    return ArtifactRef(digest=digest, url=f"file:///store/sha256/{digest[:2]}/{digest}", size=100 + n)


@pytest.fixture
def reg(registry_url: str) -> Iterator[Registry]:
    upgrade(registry_url)
    with Registry(registry_url) as r:
        yield r


def publish(reg: Registry, n: int, model: str = "m") -> int:
    return reg.publish_version(model, ref(n), LINEAGE, {"loss": 1.0 / n, "n": n}, "alice").version


def test_version_record_carries_lineage_and_is_idempotent_on_digest(reg: Registry) -> None:
    lineage = Lineage("cfg-hash", "manifest-hash", "abc123", "step-40", serving_bytes=12345)
    v = reg.publish_version("m", ref(1), lineage, {"loss": 0.5, "per_split": {"val": 0.6}}, "alice")
    assert (v.version, v.created) == (1, True)
    again = reg.publish_version("m", ref(1), LINEAGE, {"loss": 9.9}, "bob")
    assert (again.version, again.created) == (1, False)
    stored = reg.get_version("m", 1)
    assert stored == v  # the first record wins, untouched by the second publish
    assert (stored.config_hash, stored.data_manifest_hash, stored.code_revision, stored.checkpoint_tag) == (
        "cfg-hash", "manifest-hash", "abc123", "step-40")
    assert stored.serving_bytes == 12345 and stored.metrics == {"loss": 0.5, "per_split": {"val": 0.6}}
    assert stored.created_by == "alice" and stored.created_at.endswith("+00:00")
    assert stored.artifact_digest == ref(1).digest and stored.size_bytes == ref(1).size
    # The same digest under another model is a different version of that model.
    assert reg.publish_version("other", ref(1), LINEAGE, {}, "alice").version == 1


def test_version_numbers_are_per_model_and_gap_free(reg: Registry) -> None:
    assert [publish(reg, n) for n in (1, 2, 3)] == [1, 2, 3]
    assert publish(reg, 4, model="b") == 1
    with pytest.raises(Exception, match="non-finite"):
        reg.publish_version("m", ref(9), LINEAGE, {"loss": float("nan")}, "alice")
    assert publish(reg, 5) == 4  # the refused publish left no gap
    assert [v.version for v in reg.list_versions("m")] == [1, 2, 3, 4]


def test_switch_records_history_and_cas_refuses_stale_expectation(reg: Registry) -> None:
    for n in (1, 2, 3):
        publish(reg, n)
    s1 = reg.switch_alias("m", "production", 1, expect=None, actor="alice", reason="first")
    assert (s1.from_version, s1.to_version, s1.seq) == (None, 1, 1)
    s2 = reg.switch_alias("m", "production", 2, expect=1, actor="bob", reason="better")
    assert (s2.from_version, s2.to_version, s2.seq) == (1, 2, 2)
    with pytest.raises(ConflictError, match="expected version 1 but it points to version 2"):
        reg.switch_alias("m", "production", 3, expect=1, actor="carol", reason="stale")
    with pytest.raises(ConflictError, match="expected no version"):
        reg.switch_alias("m", "production", 3, expect=None, actor="carol", reason="stale")
    assert reg.live_version("m", "production").version == 2
    noop = reg.switch_alias("m", "production", 2, actor="dave", reason="again")
    assert noop.changed is False and noop.seq == 2
    hist = reg.history("m", "production")
    assert [(h.seq, h.from_version, h.to_version, h.actor, h.reason) for h in hist] == [
        (1, None, 1, "alice", "first"), (2, 1, 2, "bob", "better")]
    assert all(h.at.endswith("+00:00") for h in hist)


def test_switch_refuses_missing_or_foreign_versions(reg: Registry) -> None:
    publish(reg, 1, model="a")
    publish(reg, 2, model="b")
    publish(reg, 3, model="b")  # b has version 2, a does not
    with pytest.raises(NotFoundError, match="model 'a' has no version 2"):
        reg.switch_alias("a", "production", 2, actor="x", reason="")
    with pytest.raises(NotFoundError, match="'ghost' is not in the registry"):
        reg.switch_alias("ghost", "production", 1, actor="x", reason="")
    assert reg.live_version("a", "production") is None
    assert reg.history("a") == []


def test_rollback_default_explicit_and_nothing_to_roll_back(reg: Registry) -> None:
    for n in (1, 2, 3):
        publish(reg, n)
    with pytest.raises(NothingToRollBackError, match="points to nothing"):
        reg.rollback("m", "production", actor="ops")
    reg.switch_alias("m", "production", 1, actor="ci", reason="publish")
    with pytest.raises(NothingToRollBackError, match="first version it ever pointed to"):
        reg.rollback("m", "production", actor="ops")
    reg.switch_alias("m", "production", 3, actor="ci", reason="publish")
    rb = reg.rollback("m", "production", actor="ops", reason="bad outputs")
    assert (rb.action, rb.from_version, rb.to_version, rb.actor, rb.reason) == (
        "rollback", 3, 1, "ops", "bad outputs")
    assert reg.live_version("m", "production").version == 1
    with pytest.raises(PromotionRequiredError, match="version 2 was never live on it"):  # only ever went back
        reg.rollback("m", "production", to=2, expect=1, actor="ops", reason="pin v2")
    rb2 = reg.rollback("m", "production", to=3, expect=1, actor="ops", reason="v3 again", force=True)
    assert (rb2.from_version, rb2.to_version) == (1, 3)
    with pytest.raises(ConflictError):
        reg.rollback("m", "production", expect=1, actor="ops")
    with pytest.raises(NothingToRollBackError, match="already points to version 3"):
        reg.rollback("m", "production", to=3, actor="ops")
    with pytest.raises(NotFoundError, match="no version 7"):
        reg.rollback("m", "production", to=7, actor="ops")
    hist = reg.history("m", "production")
    assert [(h.from_version, h.to_version) for h in hist] == [(None, 1), (1, 3), (3, 1), (1, 3)]
    assert hist[-1].to_version == reg.live_version("m", "production").version


def test_rolling_back_twice_goes_further_back_never_redoes_and_rolled_back_versions_need_force(
        reg: Registry) -> None:
    """An operator's sequence: v1, v2, v3 published; v3 misbehaves (roll back), so does v2 (roll back again):
    the second rollback lands on v1, never on the v3 just rolled back; a third has nowhere left and says why.
    Putting a rolled-back version back takes force and records why."""
    for n in (1, 2, 3):
        reg.switch_alias("m", "production", publish(reg, n), actor="ci", reason="publish", action="publish")
    assert reg.rollback_target("m", "production") == 2
    first = reg.rollback("m", "production", actor="alice", reason="v3 hallucinates")
    assert (first.from_version, first.to_version) == (3, 2)
    assert reg.rollback_target("m", "production") == 1  # what the page's button shows before the click
    second = reg.rollback("m", "production", actor="bob", reason="v2 too")
    assert (second.from_version, second.to_version) == (2, 1)
    assert reg.live_version("m", "production").version == 1
    with pytest.raises(NothingToRollBackError) as nowhere:
        reg.rollback("m", "production", actor="carol")
    text = str(nowhere.value)
    assert "every version live on it before version 1 was rolled back from it" in text
    assert "v2 by bob at" in text and "'v2 too'" in text and "v3 by alice at" in text and "--force" in text
    with pytest.raises(NothingToRollBackError, match="every version live on it before version 1"):
        reg.rollback_target("m", "production")

    for again in (lambda: reg.rollback("m", "production", to=3, actor="carol"),
                  lambda: reg.switch_alias("m", "production", 3, actor="carol")):
        with pytest.raises(ForceRequiredError) as refused:
            again()
        assert "version 3 was rolled back from it by alice at" in str(refused.value)
        assert "'v3 hallucinates'" in str(refused.value) and "--force" in str(refused.value)
    with pytest.raises(ConflictError, match="expected version 2 but it points to version 1"):  # CAS news first
        reg.switch_alias("m", "production", 3, expect=2, actor="carol")
    assert reg.live_version("m", "production").version == 1 and len(reg.history("m", "production")) == 5
    with pytest.raises(InvalidInputError, match="needs a reason"):
        reg.switch_alias("m", "production", 2, actor="carol", reason=" ", force=True)

    forced = reg.switch_alias("m", "production", 2, actor="carol", reason="v2 fixed by a config change", force=True)
    assert (forced.action, forced.from_version, forced.to_version, forced.actor) == ("promote", 1, 2, "carol")
    assert forced.reason.startswith("v2 fixed by a config change [forced: v2 had been rolled back from production "
                                    "by bob at ")
    assert reg.history("m", "production")[-1] == forced
    assert not reg.switch_alias("m", "production", 2, actor="carol").changed  # already there: a no-op, not refused
    # Back from the forced v2: v1 (live before it, never rolled back), not v3; a publish never puts v3 back.
    assert reg.rollback_target("m", "production") == 1
    with pytest.raises(ConflictError, match="an automatic publish never points it there again"):
        reg.switch_alias("m", "production", 3, actor="ci", action="publish")
    back = reg.rollback("m", "production", to=3, actor="dave", reason="v3 was fine after all", force=True)
    assert (back.from_version, back.to_version) == (2, 3) and "[forced: v3 had been rolled back" in back.reason
    # force where nothing was rolled back changes nothing in the record
    plain = reg.switch_alias("m", "production", 1, actor="erin", reason="pin", force=True)
    assert plain.reason == "pin"


def test_a_rollback_onto_a_version_the_alias_never_held_is_a_promotion_and_refused(reg: Registry) -> None:
    """The attacker's sequence: v4 live on production, v5 published to staging only (its own gate); a "rollback"
    of production to v5 (forced or not, through the API every client shares) would put an ungated, unapproved
    version live. Refused, naming the alias and the promote path; production and its history are unmoved."""
    for n in (1, 2, 3, 4):
        reg.switch_alias("m", "production", publish(reg, n), actor="ci", reason="publish", action="publish")
    reg.switch_alias("m", "staging", publish(reg, 5), actor="ci", reason="publish", action="publish")
    before = reg.history("m", "production")
    for attempt in (lambda: reg.rollback("m", "production", to=5, actor="user1"),
                    lambda: reg.rollback("m", "production", to=5, actor="user1", reason="trust me", force=True),
                    lambda: reg.switch_alias("m", "production", 5, actor="user1", action="rollback")):
        with pytest.raises(PromotionRequiredError) as refused:
            attempt()
        text = str(refused.value)
        assert "alias 'production': version 5 was never live on it (it held: v1, v2, v3, v4)" in text
        assert "promote_model" in text and "retrainer promote" in text
    assert reg.live_version("m", "production").version == 4 and reg.history("m", "production") == before
    # Going back is still a rollback: to a version production held, and to staging's own past.
    assert reg.rollback("m", "production", to=2, actor="ops").to_version == 2
    assert reg.history("m", "production")[-1].action == "rollback"


def test_the_database_refuses_a_rollback_row_onto_a_version_never_held(registry_url: str) -> None:
    """Revision 0009's trigger: a client that skips the registry's code (raw SQL, an old retrainer) cannot record
    a 'rollback' onto a version the alias never pointed at; a rollback onto one it did is accepted."""
    import sqlalchemy as sa

    from tasks.registry.db import make_engine

    upgrade(registry_url)
    with Registry(registry_url) as r:
        for n in (1, 2):
            r.switch_alias("m", "production", publish(r, n), actor="ci", reason="publish", action="publish")
        publish(r, 3)
    engine = make_engine(registry_url, poolclass=sa.NullPool)
    row = ("INSERT INTO registry_alias_history (model_id, alias, seq, action, from_version, to_version, actor, "
           "reason, at) VALUES (1, 'production', 3, 'rollback', 2, {to}, 'raw', 'raw sql', CURRENT_TIMESTAMP)")
    refused = "a rollback goes only to a version the alias held before"
    with pytest.raises(sa.exc.DatabaseError, match=refused), engine.begin() as conn:
        conn.exec_driver_sql(row.format(to=3))
    with engine.begin() as conn:
        conn.exec_driver_sql(row.format(to=1))
    engine.dispose()
    with Registry(registry_url) as r:
        assert [(h.action, h.to_version) for h in r.history("m", "production")] == [
            ("publish", 1), ("publish", 2), ("rollback", 1)]


def test_show_and_models_are_json_able(reg: Registry) -> None:
    import json

    publish(reg, 1)
    publish(reg, 2)
    reg.switch_alias("m", "production", 2, actor="a", reason="")
    reg.switch_alias("m", "staging", 1, actor="a", reason="")
    info = json.loads(json.dumps(reg.show("m")))
    assert {k: v["version"] for k, v in info["aliases"].items()} == {"production": 2, "staging": 1}
    assert [v["version"] for v in info["versions"]] == [1, 2]
    assert reg.models() == [{"model": "m", "versions": 2, "aliases": {"production": 2, "staging": 1}}]
    with pytest.raises(NotFoundError):
        reg.show("nope")


def test_a_tree_version_records_its_kind_and_is_idempotent_on_its_digest(reg: Registry) -> None:
    digest = hashlib.sha256(b"a tree manifest").hexdigest()
    tree = ArtifactRef(digest, f"s3://b/models/trees/{digest[:2]}/{digest}", 10**11, kind="tree")
    v = reg.publish_version("m", tree, LINEAGE, {}, "alice")
    assert (v.version, v.artifact_kind, v.size_bytes) == (1, "tree", 10**11)
    assert reg.publish_version("m", tree, LINEAGE, {}, "bob") == v
    assert reg.get_version("m", 1).artifact_kind == "tree"
    assert publish(reg, 1) == 2 and reg.get_version("m", 2).artifact_kind == "file"
    assert [x["artifact_kind"] for x in reg.show("m")["versions"]] == ["tree", "file"]
