-- The table holds a suspect's solo runs, and is named for them.
ALTER TABLE warren_redeliveries RENAME TO warren_solo_runs;
ALTER TABLE warren_solo_runs RENAME COLUMN deliveries TO runs;
ALTER TABLE warren_solo_runs RENAME COLUMN last_delivered_at TO last_run_at;
ALTER INDEX warren_redeliveries_age RENAME TO warren_solo_runs_age;
