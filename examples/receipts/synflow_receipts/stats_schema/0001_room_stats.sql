-- room_stats: per-room counts and the position applied per (stream, writer), updated together.
CREATE TABLE room_stats (
    room_id TEXT NOT NULL PRIMARY KEY,
    messages BIGINT NOT NULL DEFAULT 0,
    receipts BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE room_stats_positions (
    stream_name TEXT NOT NULL,
    writer TEXT NOT NULL,
    position BIGINT NOT NULL,
    PRIMARY KEY (stream_name, writer)
);
