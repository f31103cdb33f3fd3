//! warren's own tables, created by numbered migrations kept as `.sql` files per
//! dialect (`src/store/migrations/<dialect>/NNNN_name.sql`).
//!
//! A file may hold several statements. Each ends with a `;` at the end of a line,
//! so the files also run as they are in `psql` or `sqlite3`. They are split here
//! and run one by one rather than sent as one string, because the drivers do not
//! treat multi-statement strings alike (PostgreSQL's extended protocol refuses
//! them). A statement that needs a `;` at the end of an inner line (a PL/pgSQL
//! body) would need a different marker; none does yet.

use super::StoreError;

/// A numbered migration: the statements of one `.sql` file, applied in order,
/// once.
pub(crate) struct Migration {
    /// The number recorded in `warren_migrations`; never reused or renumbered,
    /// since upgraded databases have it recorded.
    pub(crate) version: i64,
    /// The name recorded next to the number.
    pub(crate) name: &'static str,
    /// The file's text.
    pub(crate) sql: &'static str,
}

impl Migration {
    /// The statements of the file, in order, without their `;` and without
    /// chunks that hold only comments and blank lines.
    pub(crate) fn statements(&self) -> Vec<&'static str> {
        split_statements(self.sql)
    }
}

/// Splits `sql` after each `;` that ends a line (comment lines excepted).
pub(crate) fn split_statements(sql: &'static str) -> Vec<&'static str> {
    let mut statements = Vec::new();
    let mut start = 0;
    let mut offset = 0;
    for line in sql.split_inclusive('\n') {
        let code = line.trim_end();
        if !code.trim_start().starts_with("--") && code.ends_with(';') {
            push_statement(&mut statements, &sql[start..offset + code.len() - 1]);
            start = offset + line.len();
        }
        offset += line.len();
    }
    push_statement(&mut statements, &sql[start..]);
    statements
}

fn push_statement(statements: &mut Vec<&'static str>, chunk: &'static str) {
    let has_code = chunk
        .lines()
        .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"));
    if has_code {
        statements.push(chunk.trim());
    }
}

/// One dialect's migrations and its SQL for the bookkeeping table.
pub struct Migrations {
    /// Creates `warren_migrations` if it is missing.
    pub(crate) create_table: &'static str,
    /// Records one applied migration: binds (version, name).
    pub(crate) record: &'static str,
    /// Every migration, in version order.
    pub(crate) list: &'static [Migration],
}

impl Migrations {
    /// Applies the migrations not yet recorded, on a connection that is already in
    /// a transaction holding the dialect's migration lock.
    pub(crate) async fn apply<DB>(&self, conn: &mut DB::Connection) -> Result<(), StoreError>
    where
        DB: sqlx::Database,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        DB::Arguments: sqlx::IntoArguments<DB>,
        i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        for<'s> &'s str: sqlx::Encode<'s, DB> + sqlx::Type<DB>,
        (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx::query(self.create_table).execute(&mut *conn).await?;
        let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM warren_migrations")
            .fetch_all(&mut *conn)
            .await?;
        for m in self.list.iter().filter(|m| !applied.contains(&m.version)) {
            for statement in m.statements() {
                sqlx::query(statement)
                    .execute(&mut *conn)
                    .await
                    .map_err(|source| StoreError::Migration {
                        version: m.version,
                        name: m.name,
                        source,
                    })?;
            }
            sqlx::query(self.record)
                .bind(m.version)
                .bind(m.name)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}

/// Checks a dialect's list: versions 1..=n in order, every file split into
/// the expected number of statements, each a single statement.
#[cfg(test)]
pub(crate) fn check_list(migrations: &Migrations, statements_per_file: &[usize]) {
    assert_eq!(migrations.list.len(), statements_per_file.len());
    for (i, (m, &n)) in migrations.list.iter().zip(statements_per_file).enumerate() {
        assert_eq!(
            m.version,
            i as i64 + 1,
            "migration {} is out of order",
            m.name
        );
        assert!(!m.name.is_empty());
        let statements = m.statements();
        assert_eq!(statements.len(), n, "migration {} ({})", m.version, m.name);
        for s in statements {
            assert!(!s.contains(";\n"), "two statements in one: {s}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_end_at_a_semicolon_that_ends_a_line() {
        let sql = "-- a comment; not a statement\nCREATE TABLE t (\n    a TEXT -- ; inline\n);\n\nCREATE INDEX i ON t (a)\n    WHERE a <> ';';\n";
        assert_eq!(
            split_statements(sql),
            vec![
                "-- a comment; not a statement\nCREATE TABLE t (\n    a TEXT -- ; inline\n)",
                "CREATE INDEX i ON t (a)\n    WHERE a <> ';'",
            ]
        );
    }

    #[test]
    fn comments_and_blank_lines_alone_are_no_statement() {
        assert!(split_statements("\n-- only a note;\n\n").is_empty());
        assert_eq!(split_statements("SELECT 1"), vec!["SELECT 1"]);
    }
}
