-- The content of each room's current join rules and power levels, beside its
-- head: a persist transaction reads a room's rules with its head, in the one
-- statement, rather than joining current_state to events for them.
--
-- Written by the persist transaction that changes either (in the same
-- transaction as current_state), so each column is exactly the content of
-- the event current_state holds for (room, type, ''), or NULL if none.
ALTER TABLE rooms ADD COLUMN join_rules TEXT;
ALTER TABLE rooms ADD COLUMN power_levels TEXT;
UPDATE rooms SET
    join_rules = (SELECT e.content FROM current_state cs JOIN events e ON e.event_id = cs.event_id
                  WHERE cs.room_id = rooms.room_id AND cs.type = 'm.room.join_rules' AND cs.state_key = ''),
    power_levels = (SELECT e.content FROM current_state cs JOIN events e ON e.event_id = cs.event_id
                    WHERE cs.room_id = rooms.room_id AND cs.type = 'm.room.power_levels' AND cs.state_key = '');
