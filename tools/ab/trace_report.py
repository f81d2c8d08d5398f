"""Summary of an sm90 kernel timeline (csrc/sm90/trace.cuh; tools/ab/sm90_ab.cu built with -DJAX_FLASH_TRACE).

    python3 tools/ab/trace_report.py TRACE.bin [ROLES]

The file holds, per block and role (producer 0, consumers 1..3), kTraceRecords records of (event << 32 | aux,
SM clock). Prints, in SM cycles (medians over the blocks' tiles): the steady key-block period of each consumer (turn
to turn), the pieces of one step, the tile boundary taken apart (from the last step's turn to the next tile's
second turn) and its excess over the steady period, and when the producer issued the next tile's first loads.
"""
import collections
import statistics
import sys

import numpy as np

RECORDS, ROLES = 8192, 4
EV = dict(tile=1, q=2, turn=3, s=4, sm=5, pv=6, k=7, epi=8, drain=9, ptile=20, pq=21, pk=22, pv_load=23)
NAME = {v: k for k, v in EV.items()}

raw = np.fromfile(sys.argv[1], dtype=np.uint64).reshape(-1, ROLES, RECORDS, 2)
blocks = raw.shape[0]


def events(b, role):
    rows = raw[b, role]
    rows = rows[rows[:, 0] != 0]
    ev = (rows[:, 0] >> 32).astype(np.int64)
    aux = (rows[:, 0] & 0xFFFFFFFF).astype(np.int64)
    aux = np.where(aux >= 2**31, aux - 2**32, aux)
    return list(zip(ev.tolist(), aux.tolist(), rows[:, 1].astype(np.int64).tolist()))


def med(xs):
    return statistics.median(xs) if xs else float("nan")


consumers = [r for r in (1, 2, 3) if any((raw[b, r, 0, 0] != 0) for b in range(blocks))]
print(f"{blocks} blocks, consumers {consumers}")
steady, pieces, boundary = [], collections.defaultdict(list), collections.defaultdict(list)
tile_len, excess, start_cost, end_gap, kernel_len = [], [], [], [], []
prod_lead = []
for b in range(blocks):
    t0 = min(events(b, r)[0][2] for r in [0] + consumers if events(b, r))
    t_end = max(events(b, r)[-1][2] for r in [0] + consumers if events(b, r))
    kernel_len.append(t_end - t0)
    for r in consumers:
        ev = events(b, r)
        # split into tiles at each tile start
        tiles, cur = [], None
        for e, a, t in ev:
            if e == EV["tile"]:
                cur = dict(n=a, ev=[])
                tiles.append(cur)
            if cur is not None:
                cur["ev"].append((e, a, t))
        turns_all = []
        for ti, tile in enumerate(tiles):
            evs = tile["ev"]
            turns = [(a, t) for e, a, t in evs if e == EV["turn"]]
            if not turns:
                continue
            turns_all.append([t for _, t in turns])
            if ti + 1 < len(tiles):
                tile_len.append(tiles[ti + 1]["ev"][0][2] - evs[0][2])
            ts = [t for _, t in turns]
            periods = [y - x for x, y in zip(ts[1:-1], ts[2:])]  # steps after the first step
            steady.extend(periods)
            by = collections.defaultdict(list)
            for e, a, t in evs:
                by[(e, a)].append(t)
            for (j, _), (j2, _) in zip(turns[1:-1], turns[2:]):  # the pieces of a steady step j2
                try:
                    tk = by[(EV["k"], j2)][0]; tt = by[(EV["turn"], j2)][0]; tsd = by[(EV["s"], j2)][0]
                    tsm = by[(EV["sm"], j2)][0]; tpv = by[(EV["pv"], j2)][0]; tprev_pv = by[(EV["pv"], j)][0]
                except (IndexError, KeyError):
                    continue
                pieces["prev P V done -> K ready"].append(tk - tprev_pv)
                pieces["K ready -> turn"].append(tt - tk)
                pieces["turn -> S done"].append(tsd - tt)
                pieces["S done -> softmax done"].append(tsm - tsd)
                pieces["softmax done -> P V done"].append(tpv - tsm)
            # the boundary into this tile: from the previous tile's last step turn
            if ti == 0:
                start_cost.append(ts[0] - t0)
                continue
            prev = tiles[ti - 1]["ev"]
            prev_turns = [t for e, a, t in prev if e == EV["turn"]]
            if not prev_turns or len(ts) < 2:
                continue
            d = collections.OrderedDict()
            get = lambda lst, e: [t for ee, a, t in lst if ee == EV[e]]
            last_turn = prev_turns[-1]
            dr = get(prev, "drain"); pvd = [t for ee, a, t in prev if ee == EV["pv"] and a == -1]
            epi = get(prev, "epi"); tst = evs[0][2]; q = get(evs, "q"); ks = get(evs, "k"); sd = get(evs, "s")
            smd = get(evs, "sm")
            if not (dr and pvd and epi and q and ks and sd and smd):
                continue
            d["last step turn -> drain turn"] = dr[0] - last_turn
            d["drain turn -> last P V done"] = pvd[0] - dr[0]
            d["last P V done -> epilogue done"] = epi[0] - pvd[0]
            d["epilogue done -> tile start"] = tst - epi[0]
            d["tile start -> Q ready"] = q[0] - tst
            d["Q ready -> K_0 ready"] = ks[0] - q[0]
            d["K_0 ready -> prologue turn"] = ts[0] - ks[0]
            d["prologue turn -> S_0 done"] = sd[0] - ts[0]
            d["S_0 done -> P_0 ready"] = smd[0] - sd[0]
            d["P_0 ready -> K_1 ready"] = ks[1] - smd[0] if len(ks) > 1 else float("nan")
            d["K_1 ready -> step-1 turn"] = ts[1] - ks[1] if len(ks) > 1 else float("nan")
            for k_, v_ in d.items():
                boundary[(r, k_)].append(v_)
            boundary[(r, "TOTAL last step turn -> step-1 turn")].append(ts[1] - last_turn)
        if turns_all:
            end_gap.append(t_end - turns_all[-1][-1])
    # producer: the next tile's K_0 issue relative to the consumers' need
    pev = events(b, 0)
    pk = [(a, t) for e, a, t in pev if e == EV["pk"]]
    prod_lead.append(len(pk))

P = med(steady)
print(f"steady period (a consumer's turn to its next, one key block of both consumers): {P:.0f} cycles "
      f"(p10 {np.percentile(steady, 10):.0f}, p90 {np.percentile(steady, 90):.0f}, n={len(steady)})")
print(f"tile length median {med(tile_len):.0f} cycles = {med(tile_len) / P:.2f} periods")
print(f"kernel (first to last event, median over blocks) {med(kernel_len):.0f} cycles; first turn after start "
      f"{med(start_cost):.0f}; last turn to block end {med(end_gap):.0f}")
print("steady step pieces (median cycles):")
for k_, v_ in pieces.items():
    print(f"  {k_:36s} {med(v_):8.0f}")
for r in consumers:
    print(f"tile boundary, consumer {r} (median cycles):")
    for (rr, k_), v_ in boundary.items():
        if rr == r:
            print(f"  {k_:44s} {med(v_):8.0f}  (p90 {np.percentile(v_, 90):.0f})")
    tot = med(boundary[(r, 'TOTAL last step turn -> step-1 turn')])
    print(f"  excess over 2 periods: {tot - 2 * P:.0f} cycles = {(tot - 2 * P) / P:.2f} key blocks")
