/*
 * kvpol_sections.h: the one table of section groups and section ids (data only). The format
 * library's registry (formats/kvpol_common.c), the compiler passes that write the sections, the
 * runtime loaders that read them and kvcc's group names all expand these tables; no other file
 * spells an id or a name. docs/kvpol-format.md describes every section's items.
 *
 * Adding a policy: one KVPOL_GROUPS row (ids only grow; a retired group keeps its number) and
 * one KVPOL_SECTIONS row per section. Included by kvpol.h.
 */
#ifndef KVPOL_SECTIONS_H
#define KVPOL_SECTIONS_H

/* X(ENUM, number, "name"): the policy groups (id = (group << 16) | index). */
#define KVPOL_GROUPS(X)                                                                          \
    X(KVPOL_GROUP_CORE, 0, "core")                                                               \
    X(KVPOL_GROUP_COMPILERKV, 1, "compilerkv")                                                   \
    X(KVPOL_GROUP_AM, 2, "am")                                                                   \
    X(KVPOL_GROUP_COMPKV, 3, "compkv")                                                           \
    X(KVPOL_GROUP_KV2, 4, "kv2")                                                                 \
    X(KVPOL_GROUP_MERGE_REDUCE, 5, "merge-reduce")

/* X(MACRO, group, index, max_group_version, "name"): the sections this library knows, with the
 * newest group version it reads. Which are critical is the writer's flag (docs/kvpol-format.md
 * states it per section). */
#define KVPOL_SECTIONS(X)                                                                        \
    X(KVPOL_SEC_PROVENANCE, KVPOL_GROUP_CORE, 1, 1, "kvcc.provenance")                           \
    X(KVPOL_SEC_SELFTEST, KVPOL_GROUP_CORE, 0xFFFF, 1, "kvcc.selftest")                          \
    X(KVPOL_SEC_COMPILERKV_TABLES, KVPOL_GROUP_COMPILERKV, 1, 1, "compilerkv.tables")            \
    X(KVPOL_SEC_AM_SCHEDULE, KVPOL_GROUP_AM, 1, 1, "am.schedule")                                \
    X(KVPOL_SEC_AM_CURVES, KVPOL_GROUP_AM, 2, 1, "am.curves")                                    \
    X(KVPOL_SEC_COMPKV_GROUPINGS, KVPOL_GROUP_COMPKV, 1, 1, "compkv.groupings")                  \
    X(KVPOL_SEC_COMPKV_CALIBRATION, KVPOL_GROUP_COMPKV, 2, 1, "compkv.calibration")              \
    X(KVPOL_SEC_KV2_SCHEDULE, KVPOL_GROUP_KV2, 1, 1, "kv2.schedule")                             \
    X(KVPOL_SEC_KV2_CURVES, KVPOL_GROUP_KV2, 2, 1, "kv2.curves")                                 \
    X(KVPOL_SEC_MR_BASIS, KVPOL_GROUP_MERGE_REDUCE, 1, 1, "merge-reduce.basis")                  \
    X(KVPOL_SEC_MR_REPORT, KVPOL_GROUP_MERGE_REDUCE, 2, 1, "merge-reduce.report")

#endif /* KVPOL_SECTIONS_H */
