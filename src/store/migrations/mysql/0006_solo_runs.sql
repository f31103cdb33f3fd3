-- The table holds a suspect's solo runs, and is named for them.
RENAME TABLE warren_redeliveries TO warren_solo_runs;
ALTER TABLE warren_solo_runs
    RENAME COLUMN deliveries TO runs,
    RENAME COLUMN last_delivered_at TO last_run_at,
    RENAME INDEX warren_redeliveries_age TO warren_solo_runs_age;
