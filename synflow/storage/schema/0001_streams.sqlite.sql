-- SQLite variant: instance IDs from INTEGER PRIMARY KEY; sequences as rows.
CREATE TABLE instance_map (
    instance_id INTEGER PRIMARY KEY AUTOINCREMENT,
    instance_name TEXT NOT NULL UNIQUE
);

CREATE TABLE stream_positions (
    stream_name TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (stream_name, instance_name)
);

-- One row per stream: the last stream ID handed out. A writer bumps it inside
-- its writing transaction (which holds SQLite's write lock).
CREATE TABLE stream_sequences (
    stream_name TEXT PRIMARY KEY,
    last_id BIGINT NOT NULL
);
INSERT INTO stream_sequences (stream_name, last_id) VALUES ('events', 1);
INSERT INTO stream_sequences (stream_name, last_id) VALUES ('caches', 1);
INSERT INTO stream_sequences (stream_name, last_id) VALUES ('federation', 1);

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
