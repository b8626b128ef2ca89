#!/usr/bin/env bash
# Slurm PrologSlurmctld example: publish the nodes of each job as Prometheus file_sd targets, labelled
# with the job, so one job's nodes can be picked in the dashboards. Runs on the controller.
set -euo pipefail
targets_dir=${STALLWATCH_TARGETS_DIR:-/etc/prometheus/targets.d}
port=${STALLWATCH_PORT:-9842}
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/:$port/" | paste -sd, -)
printf '[{"targets": ["%s"], "labels": {"slurm_job_id": "%s"}}]\n' \
  "${nodes//,/\", \"}" "$SLURM_JOB_ID" >"$targets_dir/stallwatch-job-$SLURM_JOB_ID.json.tmp"
mv "$targets_dir/stallwatch-job-$SLURM_JOB_ID.json.tmp" "$targets_dir/stallwatch-job-$SLURM_JOB_ID.json"
