//! The order of runs in one workload: a warm-up of each arm, then N pairs alternating AB, BA,
//! AB, ... so that neither arm always runs first (a systematic first-run or second-run effect,
//! such as the page cache the previous run leaves, then cancels out across pairs).

/// One of the two arms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArmId {
    A,
    B,
}

/// One run of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub arm: ArmId,
    /// The pair this run belongs to; `None` for a warm-up (never measured).
    pub pair: Option<usize>,
}

/// Warm-up A, warm-up B, then pair 0 as AB, pair 1 as BA, pair 2 as AB, ...
pub fn schedule(pairs: usize) -> Vec<Slot> {
    let mut v = vec![
        Slot {
            arm: ArmId::A,
            pair: None,
        },
        Slot {
            arm: ArmId::B,
            pair: None,
        },
    ];
    for p in 0..pairs {
        let (first, second) = if p % 2 == 0 {
            (ArmId::A, ArmId::B)
        } else {
            (ArmId::B, ArmId::A)
        };
        v.push(Slot {
            arm: first,
            pair: Some(p),
        });
        v.push(Slot {
            arm: second,
            pair: Some(p),
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use ArmId::*;

    #[test]
    fn warm_ups_come_first_and_are_not_measured() {
        let s = schedule(3);
        assert_eq!(s[0], Slot { arm: A, pair: None });
        assert_eq!(s[1], Slot { arm: B, pair: None });
        assert!(s[2..].iter().all(|x| x.pair.is_some()));
    }

    #[test]
    fn pairs_alternate_ab_and_ba() {
        let s = schedule(4);
        let order: Vec<ArmId> = s[2..].iter().map(|x| x.arm).collect();
        assert_eq!(order, [A, B, B, A, A, B, B, A]);
        for p in 0..4 {
            let members: Vec<&Slot> = s.iter().filter(|x| x.pair == Some(p)).collect();
            assert_eq!(members.len(), 2, "pair {p}");
            assert_ne!(members[0].arm, members[1].arm);
        }
    }

    #[test]
    fn each_arm_leads_equally_often_in_an_even_number_of_pairs() {
        for n in [2usize, 10, 20] {
            let s = schedule(n);
            let a_first = (0..n)
                .filter(|&p| s.iter().find(|x| x.pair == Some(p)).unwrap().arm == A)
                .count();
            assert_eq!(a_first, n / 2);
            assert_eq!(s.len(), 2 + 2 * n);
        }
    }
}
