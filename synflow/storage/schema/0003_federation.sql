-- Federation: destination retry state, per-room catch-up marks, inbound dedupe.

CREATE TABLE destinations (
    destination TEXT PRIMARY KEY,
    retry_last_ts BIGINT NOT NULL DEFAULT 0,
    retry_interval BIGINT NOT NULL DEFAULT 0,
    failure_ts BIGINT,
    last_successful_stream_ordering BIGINT,
    last_successful_token TEXT
);

-- The latest event of each room that a destination still needs.
CREATE TABLE destination_rooms (
    destination TEXT NOT NULL,
    room_id TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    PRIMARY KEY (destination, room_id)
);
CREATE INDEX destination_rooms_room ON destination_rooms (room_id);

CREATE TABLE received_transactions (
    origin TEXT NOT NULL,
    txn_id TEXT NOT NULL,
    response_code INTEGER NOT NULL,
    response_json TEXT NOT NULL,
    received_ts BIGINT NOT NULL,
    PRIMARY KEY (origin, txn_id)
);

-- How far each federation sender has processed each stream (a token).
CREATE TABLE federation_stream_position (
    type TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    token TEXT NOT NULL,
    PRIMARY KEY (type, instance_name)
);
