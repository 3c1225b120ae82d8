"""The test infrastructure itself: real PostgreSQL and a real S3 endpoint answer."""

import sqlalchemy as sa


def test_postgres_answers(pg_url: str) -> None:
    with sa.create_engine(pg_url).connect() as conn:
        assert conn.execute(sa.text("select 1 + 1")).scalar() == 2


def test_s3_round_trip(s3, s3_bucket: str) -> None:
    fs = s3.filesystem()
    fs.pipe(f"{s3_bucket}/k", b"hello")
    assert fs.cat(f"{s3_bucket}/k") == b"hello"
