-- The receipts stream: one row per receipt, its stream ID from receipts_stream_seq.
CREATE TABLE receipts (
    stream_id BIGINT NOT NULL PRIMARY KEY,
    instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    event_id TEXT NOT NULL
);
CREATE INDEX receipts_writer ON receipts (instance_name, stream_id);
CREATE INDEX receipts_room ON receipts (room_id, stream_id);
