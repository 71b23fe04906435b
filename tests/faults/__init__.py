"""The fault matrix: what vllm-deltasync refuses and survives (issue 13). One test per row.

Each row asserts what applies: the step is refused or the fault survived; nothing partial or
wrong is staged or applied (the poller stages only the good steps before it; engine rows compare
rank digests with the last good step); the fault is counted with a bounded label (an error class
name); the CLI prints one line and exits nonzero without a traceback; planted secrets appear in
no log, exception, status or CLI output. Misbehaving servers are real: a small aiohttp server on
127.0.0.1 (``conftest.Hostile``) and the local Hub server's fault switches
(tests/helpers/hubserver.py). Nothing sends traffic off loopback.

=====================================================  ==========================================
row (file :: test)                                     fault -> what holds
=====================================================  ==========================================
**1. coverage** (test_format_faults.py)
anchor_leaving_a_tensor_out                            refused by reader, verify, poller
anchor_covering_a_tensor_in_part                       refused by reader, verify, poller
v2_delta_listing_a_chunk_twice                         refused by reader, verify, poller
v1_sparse_v2_delta_listing_a_chunk_twice               verify reports it, exit 1
two_writers_chunks_overlapping_in_one_step             refused by reader, verify, poller
**2. secrets** (test_secret_faults.py)
credentials_in_a_bucket_url[4 URL forms]               one line naming credential sources; no echo
                                                       (open_store, publisher, poller, CLI, logs)
redaction_of_urls_inside_any_text                      userinfo, queries, key=value secrets masked
hostile_server_echoing_the_token                       the token is masked in errors and logs
status_cli_redacts_userinfo_and_query                  no secret in ``status`` output
synced_and_metrics_never_show_a_url_secret             /synced, /metrics redact rank and engine
                                                       errors and the bucket label
engine_core_failures_never_show_a_secret               coordinator last_error, status, log + traceback
**3. two writers** (test_writer_faults.py)
second_writer_on_hf_is_named_within_one_step           PublishError naming both tokens
neither_writer_deletes_the_others_data                 retention keeps the other token's files
readers_never_mix_two_runs                             every chain is one run; bits exact
**4. hostile HTTP** (test_http_faults.py)
redirect_loop_is_capped                                StoreError after 10 hops, counted
redirect_to_private_or_link_local[2]                   refused before any connection, not retried
redirect_rule_table                                    same class and public allowed; option adds
trickling_body_is_cut_by_the_minimum_rate              min_bytes_per_s over rate_window_s (hf)
trickling_s3_body_is_cut_by_the_minimum_rate           the same on s3:// (a loopback server plays S3)
endless_fast_body_is_cut_by_the_request_cap            max_request_s
events_feed_redirect_is_not_followed                   StoreError, polling instead
**5. quota burn** (test_quota_faults.py)
corrupt_step_is_not_downloaded_every_poll              <= 6 downloads in 30 poll intervals; the
                                                       good steps staged; error kept and counted
**6. memory** (test_format_faults.py)
zstd_frame_claiming_a_terabyte                         refused before decompressing
zstd_raw_size_beyond_what_the_chunk_may_hold           raw_bytes bounded by 14 B per element
shape_of_1e15_elements                                 parser refuses; CLI one line
region_rows_beyond_the_tensor                          refused before the coverage arrays
**7. events feed** (test_http_faults.py)
malformed_event_does_not_stop_the_feed                 counted, the next event still arrives
silent_feed_is_noticed_and_discovery_falls_back        a probe finds the step the feed missed
feed_silent_past_the_idle_limit_reconnects             events_idle_s
**8. messages and validation**
manifest_parser_is_strict[7] (test_format_faults.py)   string shape, float dim, NaN, UTF-16,
                                                       NUL in path, nesting, huge integers
out_of_range_codec_metadata_is_one_problem_line        FormatError, verify one line
verify_decodes_and_reports_undecodable_chunks          digests fine, decoding refuses
verify_reports_an_unknown_encoding
html_listing_is_one_cli_line (test_http_faults.py)
bad_size_in_listing_and_header_is_refused
status_of_something_that_is_not_our_metrics            one line per server, exit 1
nonexistent_directory_is_an_error[3]                   (test_cli_publisher_faults.py)
cli_never_prints_a_traceback_even_for_unexpected_errors
publish_of_a_step_past_twelve_digits                   PublishError at publish time
temp_files_of_a_killed_publisher_are_removed           stale ones only; a live writer's kept
unfinished_s3_uploads_of_a_killed_publisher_are_aborted  s3:// multipart parts, older than stale_upload_s
**9. scripts** (test_setup_faults.py)
setup_never_stops_a_process_by_name
setup_keeps_the_package_service_from_starting          policy-rc.d 101 during apt-get install
setup_leaves_an_existing_policy_alone
**10. engine** (test_engine_faults.py, marked ``engine``: one TP=1 engine on hf://, in order)
bucket_unreachable_for_minutes_keeps_serving_and...     every request 503 for 20 poll intervals:
                                                       same outputs, errors counted, catches up
anchor_failing_half_way_holds_then_resyncs             hold path; resync through a whole anchor;
                                                       digests equal the checkpoint
trainer_restarted_from_an_earlier_step_with_a_new_run  new run after the newest step, entered
                                                       through its anchor; digests exact
api_server_killed_and_restarted_catches_up             SIGKILL while following; restart reaches
                                                       the newest step through an anchor
=====================================================  ==========================================
"""
