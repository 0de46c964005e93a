-- Events, rooms, membership and users.

CREATE TABLE events (
    stream_ordering BIGINT PRIMARY KEY,
    instance_name TEXT NOT NULL,
    event_id TEXT NOT NULL UNIQUE,
    room_id TEXT NOT NULL,
    type TEXT NOT NULL,
    state_key TEXT,
    sender TEXT NOT NULL,
    membership TEXT,
    content TEXT NOT NULL,
    origin_server_ts BIGINT NOT NULL,
    origin TEXT NOT NULL,
    prev_event_id TEXT,
    depth BIGINT NOT NULL,
    received_ts BIGINT NOT NULL,
    -- For events created here: the remote servers in the room at this event
    -- (a JSON list), which the federation senders send it to.
    destinations TEXT
);
CREATE INDEX events_room_ordering ON events (room_id, stream_ordering);
CREATE INDEX events_instance_ordering ON events (instance_name, stream_ordering);

-- Client transaction IDs, so a retried send returns the same event.
CREATE TABLE event_txn_ids (
    user_id TEXT NOT NULL,
    txn_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    instance_name TEXT NOT NULL,
    PRIMARY KEY (user_id, txn_id)
);

CREATE TABLE rooms (
    room_id TEXT PRIMARY KEY,
    creator TEXT NOT NULL,
    created_ts BIGINT NOT NULL,
    latest_event_id TEXT,
    latest_depth BIGINT NOT NULL DEFAULT 0,
    latest_stream_ordering BIGINT
);

-- Current membership of each user in each room (joined, invited, left).
CREATE TABLE room_memberships (
    room_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    server_name TEXT NOT NULL,
    membership TEXT NOT NULL,
    event_id TEXT NOT NULL,
    stream_ordering BIGINT NOT NULL,
    PRIMARY KEY (room_id, user_id)
);
CREATE INDEX room_memberships_user ON room_memberships (user_id, membership);

CREATE TABLE current_state (
    room_id TEXT NOT NULL,
    type TEXT NOT NULL,
    state_key TEXT NOT NULL,
    event_id TEXT NOT NULL,
    PRIMARY KEY (room_id, type, state_key)
);

CREATE TABLE users (
    user_id TEXT PRIMARY KEY,
    created_ts BIGINT NOT NULL
);

CREATE TABLE access_tokens (
    token_hash TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    device_id TEXT,
    created_ts BIGINT NOT NULL
);
CREATE INDEX access_tokens_user ON access_tokens (user_id);
