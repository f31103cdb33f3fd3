-- The table holds a suspect's solo runs, and is named for them. SQLite renames
-- no index: the old one is dropped and the new one built.
ALTER TABLE warren_redeliveries RENAME TO warren_solo_runs;
ALTER TABLE warren_solo_runs RENAME COLUMN deliveries TO runs;
ALTER TABLE warren_solo_runs RENAME COLUMN last_delivered_at TO last_run_at;
DROP INDEX warren_redeliveries_age;
CREATE INDEX warren_solo_runs_age ON warren_solo_runs (consumer_name, last_run_at);
