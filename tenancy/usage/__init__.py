"""Usage: the rows of finished requests (`writer`: `UsageRow`, the group-committing
`UsageWriter`) and the totals read back from them (`report`: `usage_report`)."""
