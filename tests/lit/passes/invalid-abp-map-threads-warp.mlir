// RUN: abp-opt %s -abp-map-threads=warp-max-cols=-1 -verify-diagnostics

// expected-error @below {{abp-map-threads: warp-max-cols must be >= 0, got -1}}
module {
}
