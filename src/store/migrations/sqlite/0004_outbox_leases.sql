-- SQLite has no row locks: a relay leases the rows of its batch instead.
ALTER TABLE warren_outbox ADD COLUMN lease_until TEXT NULL;
