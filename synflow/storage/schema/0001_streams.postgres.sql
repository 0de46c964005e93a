-- PostgreSQL variant: SERIAL instance IDs and one sequence per stream. The
-- sequences start at 2 (never called), so the first stream ID is 2 and an
-- empty stream is at position 1.
CREATE TABLE instance_map (
    instance_id SERIAL PRIMARY KEY,
    instance_name TEXT NOT NULL UNIQUE
);

CREATE TABLE stream_positions (
    stream_name TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (stream_name, instance_name)
);

CREATE SEQUENCE events_stream_seq START WITH 2;
CREATE SEQUENCE caches_stream_seq START WITH 2;
CREATE SEQUENCE federation_stream_seq START WITH 2;

CREATE TABLE cache_invalidations (
    stream_id BIGINT PRIMARY KEY,
    instance_name TEXT NOT NULL,
    cache_name TEXT NOT NULL,
    keys TEXT,
    invalidation_ts BIGINT NOT NULL
);
CREATE INDEX cache_invalidations_instance ON cache_invalidations (instance_name, stream_id);

CREATE TABLE federation_outbox (
    stream_id BIGINT PRIMARY KEY,
    instance_name TEXT NOT NULL,
    destination TEXT NOT NULL,
    edu_type TEXT NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX federation_outbox_instance ON federation_outbox (instance_name, stream_id);
