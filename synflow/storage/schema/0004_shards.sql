-- Live resharding: each shard group's current epoch and the hand-over in progress.
-- Groups: 'events' (rooms over event persisters) and 'federation'
-- (destinations over federation senders).
--
-- shard_state holds one row per stream that reshards. Every persist
-- transaction reads its stream's row (on PostgreSQL FOR KEY SHARE), and the
-- coordinator changes it only under FOR UPDATE, so a change of epoch waits
-- for every write begun under the previous one: no room ever has two writers.
CREATE TABLE shard_state (
    stream TEXT PRIMARY KEY,
    epoch BIGINT NOT NULL,
    pending BIGINT
);
INSERT INTO shard_state (stream, epoch, pending) VALUES ('events', 0, NULL);
INSERT INTO shard_state (stream, epoch, pending) VALUES ('federation', 0, NULL);

-- One row per epoch: epoch 0 is the base list (stored at the first reshard),
-- every later one adds or removes one writer. state: pending, current or
-- rolled_back (a rolled-back epoch's number is never reused).
CREATE TABLE shard_epochs (
    stream TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    op TEXT NOT NULL,
    writer TEXT NOT NULL,
    writers TEXT NOT NULL,
    address TEXT,
    state TEXT NOT NULL,
    floor_position BIGINT NOT NULL,
    proposed_ts BIGINT NOT NULL,
    finished_ts BIGINT,
    -- keys (rooms or destinations) the epoch moved, of those known when it committed
    moved BIGINT,
    total BIGINT,
    PRIMARY KEY (stream, epoch)
);
